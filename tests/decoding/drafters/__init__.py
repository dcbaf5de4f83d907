"""Tests of decoding/drafters/: the lookup sources, tries, the merge, the review and the
default drafting."""
