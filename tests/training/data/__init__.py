"""Tests of training/data/: records and their checks, self-distillation, the resumable job and its
shards, training on the job's shards, the prompt writers."""
