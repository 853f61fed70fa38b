"""`python -m moebalance.cli`: the installed `moebalance` command."""

from moebalance.cli import entry

entry()
