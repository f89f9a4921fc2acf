"""`tandem up`: starts Redis, the workers and the router on one machine, and stops them all."""
