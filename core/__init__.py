"""The project-wide utilities every floor stands on, importing nothing of draftheads': the error
root and its kinds (:mod:`.errors`), files and folders written whole (:mod:`.atomic`), tensors
kept past inference mode (:mod:`.kept`) and weights' content fingerprints (:mod:`.content`)."""
