"""Training runs and checkpoints as stored things: `tinker://` paths, names, storage folders and
who may read them (`checkpoints`), and the sweeper that expires sessions and checkpoints
(`expiry`)."""
