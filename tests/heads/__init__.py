"""Tests of heads/: the head families."""
