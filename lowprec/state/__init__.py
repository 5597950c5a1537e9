"""Training state on disk, below the layers that checkpoint it (``optim``'s state, ``distributed``'s
checkpoints, ``train``'s runs): the checkpoint files (``files``) and whether one fits a run (``checks``)."""
