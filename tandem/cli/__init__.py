"""The `tandem` command: one subcommand per role, each in its own module; `main` is the entry point."""
