"""Command-line flags, each declared once: its name, type, help, --help section and owners.

A `Flag` is declared in the module of the process that owns it (the engine's in tandem/engine_args.py,
a worker's, the router's, the gateway's and the launcher's beside their config dataclass; those that
several processes take in services/common). Its default is never written in the declaration when the
owner's config has it: `field` names the attribute of each owner's config that holds it, so
`tandem router --drain-timeout` defaults to RouterConfig's and `tandem prefill --drain-timeout` to
WorkerConfig's, from the one declaration.

`tandem up` adds every flag of its children (engine, worker, router, gateway) whose `up` is not
`Owner.NONE`, and gives each child the flags declared for it that the user changed (`forwarded`):
no list of forwarded flags is written anywhere else. tests/tandem/test_flags.py holds each option
string to one declaration (the few names that mean different things in different commands are
listed there).

Torch-free; nothing here touches the environment.
"""

from __future__ import annotations

import argparse
import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import reduce
from weakref import WeakKeyDictionary

from tandem.services.common.arg_groups import arg_group


class Owner(enum.Flag):
    """The processes that take a flag."""

    NONE = 0
    LAUNCHER = enum.auto()   # `tandem up` itself
    ENGINE = enum.auto()     # every process that runs a model: the workers, `tandem generate`
    WORKER = enum.auto()     # prefill, decode and co-located workers (their service-level flags)
    ROUTER = enum.auto()
    GATEWAY = enum.auto()
    PLANNER = enum.auto()    # the SLO planner (`tandem up --planner` starts it)


# The order a default is looked up in when several owners of a flag are present (`tandem up`).
OWNER_ORDER = (Owner.LAUNCHER, Owner.ENGINE, Owner.WORKER, Owner.ROUTER, Owner.GATEWAY, Owner.PLANNER)
SERVICES = Owner.WORKER | Owner.ROUTER | Owner.GATEWAY
_NAMES = {Owner.LAUNCHER: "launcher", Owner.ENGINE: "engine", Owner.WORKER: "workers", Owner.ROUTER: "router",
          Owner.GATEWAY: "gateway", Owner.PLANNER: "planner"}

@dataclass(frozen=True, eq=False)   # eq=False: a declaration is itself, whatever it says
class Flag:
    names: tuple[str, ...]           # option strings, the canonical one first
    owners: Owner                    # the processes that take it
    group: str                       # its --help section (services/common/arg_groups.py)
    help: str
    field: str | None = None         # dotted attribute of each owner's config holding the default
    default: object = None           # the default when no config has one
    type: Callable[[str], object] | None = None
    choices: Sequence[str] | Callable[[], Sequence[str]] | None = None
    metavar: str | None = None
    action: str = "store"            # store | append | store_true | store_false | on_off
    dest: str | None = None
    off: tuple[str, ...] = ()        # on_off: the option strings that turn it off (`--disable-X`, aliases)
    off_help: str = ""
    # What `tandem up` does with it: forward it to these of its children, and LAUNCHER: `tandem up`
    # reads it itself (it places its children: ports, registry, API key). None: to every owner;
    # Owner.NONE: not a flag of `tandem up`.
    up: Owner | None = None

    def __post_init__(self):
        assert self.action in ("store", "append", "store_true", "store_false", "on_off"), self.action
        assert (self.action == "on_off") == bool(self.off), self.names
        assert self.action not in ("store_true", "store_false") or self.field or self.default is not None, \
            f"{self.name}: a switch needs its default"

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def dest_name(self) -> str:
        return self.dest or self.name.lstrip("-").replace("-", "_")

    @property
    def up_targets(self) -> Owner:
        return self.owners if self.up is None else self.up

    def default_in(self, configs: Mapping[Owner, object], among: Owner | None = None) -> object:
        """The default of the first owner (of `among`, default: all owners) whose config is given."""
        if self.field is None:
            return self.default
        among = self.owners if among is None else among
        for owner in OWNER_ORDER:
            if owner & among and owner in configs:
                return reduce(getattr, self.field.split("."), configs[owner])
        raise KeyError(f"{self.name}: no config of {among} given")

    def add_to(self, p: argparse.ArgumentParser, default: object, help_prefix: str = "") -> None:
        group = arg_group(p, self.group)
        text = help_prefix + self.help
        if self.action == "on_off":
            if default is not None:   # None: decided at start, which the help says
                text += f" (default: {'on' if default else 'off'})"
            pair = group.add_mutually_exclusive_group()
            # Both carry the default: argparse would report store_false's implicit True.
            actions = [pair.add_argument(*self.names, dest=self.dest_name, action="store_true", default=default,
                                         help=text),
                       pair.add_argument(*self.off, dest=self.dest_name, action="store_false", default=default,
                                         help=self.off_help)]
        else:
            kw = {"type": self.type, "metavar": self.metavar,
                  "choices": self.choices() if callable(self.choices) else self.choices}
            actions = [group.add_argument(*self.names, dest=self.dest_name, action=self.action, default=default,
                                          help=text, **{k: v for k, v in kw.items() if v is not None})]
        for action in actions:
            _DECLARED[action] = self

    def argv(self, value: object) -> list[str]:
        """`value` (not the default) as a command line."""
        if self.action == "append":
            return [x for v in value for x in (self.name, str(v))]
        if self.action == "on_off":
            return [self.name if value else self.off[0]]
        if self.action in ("store_true", "store_false"):
            return [self.name]
        return [self.name, str(value)]


_DECLARED: WeakKeyDictionary[argparse.Action, Flag] = WeakKeyDictionary()


def declaration_of(action: argparse.Action) -> Flag | None:
    """The Flag an argparse action was added from (None: added by hand)."""
    return _DECLARED.get(action)


def owner_names(owners: Owner) -> str:
    return "+".join(_NAMES[o] for o in OWNER_ORDER if o & owners)


def add_flags(p: argparse.ArgumentParser, flags: Iterable[Flag], configs: Mapping[Owner, object]) -> None:
    """Add `flags` to `p`, each flag's default from the first of its owners' `configs`."""
    for flag in flags:
        flag.add_to(p, flag.default_in(configs))


def unique(*groups: Iterable[Flag]) -> list[Flag]:
    """The flags of `groups` in order, each once (a flag several processes take is in several groups)."""
    return list({id(f): f for g in groups for f in g}.values())


def flags_of(p: argparse.ArgumentParser) -> list[Flag]:
    return unique(f for a in p._actions if (f := declaration_of(a)) is not None)


def forwarded(args: argparse.Namespace, p: argparse.ArgumentParser, to: Owner) -> list[str]:
    """The flags of `p` that `tandem up` forwards to a process taking `to`'s flags, as its command
    line: those whose value in `args` is not `p`'s default (the user set them). Unset ones are left to
    the child's own default."""
    out: list[str] = []
    for flag in flags_of(p):
        if flag.up_targets & to:
            value = getattr(args, flag.dest_name)
            if value != p.get_default(flag.dest_name):
                out += flag.argv(value)
    return out
