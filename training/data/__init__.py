"""The training data: what the trainer reads and the jobs that make it.

Reading: :mod:`.records` (local files, folders or Hub datasets → examples), :mod:`.data_checks`
(every record checked before the base loads), :mod:`.job_data` (the self-distillation job's
shards as training positions, memory-mapped). Making: :mod:`.self_distillation` (the base
answers a prompt set), the resumable job :mod:`.distill_job` with :mod:`.distill_shards` (its
format) and :mod:`.distill_capture` (features from the decoder's own forwards), the prompt
writers :mod:`.self_prompts` and :mod:`.passage_prompts`, and :mod:`.config_cli` (the jobs'
command lines)."""
