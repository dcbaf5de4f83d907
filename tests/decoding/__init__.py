"""Tests of decoding/: acceptance, trees, the step and the loop, limits, the policy and its
calibration."""
