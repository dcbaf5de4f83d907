"""Tests of training/: features and labels, the framework, data, preflight, adversarial training,
resume."""
