"""Tests of scripts/ run end to end."""
