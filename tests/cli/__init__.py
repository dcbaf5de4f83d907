"""Tests of the package root draftheads/: the command line, bench, demo, checkpoint commands,
custom_generate, plots."""
