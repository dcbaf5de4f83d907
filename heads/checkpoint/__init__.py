"""The head checkpoint format: the folder written and read (:mod:`.io`: ``save_pretrained`` /
``from_pretrained``), files and folders written whole (:mod:`.atomic`), the Hub (:mod:`.hub`),
model cards (:mod:`.card`), and the conversions from and to other projects' formats
(:mod:`.medusa_import`, :mod:`.vllm_export`)."""
