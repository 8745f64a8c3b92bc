"""What a run keeps on disk: its directory (``rundir``) and its lock (``rundir_lock``),
checkpoints (``checkpoint``, ``manifest``, ``state_tree``), lineage (``lineage``), disk-space
guards (``diskspace``) and the replay store read back from a checkpoint (``replay_inspect``)."""
