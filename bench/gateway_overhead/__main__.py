"""`python -m bench.gateway_overhead`: see the package docstring."""

from bench.gateway_overhead.cli import main

main()
