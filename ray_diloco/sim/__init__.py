"""Layer: sim (pure, no Ray). Runs on a virtual clock: the in-process reference run of M
learners and the synchronizer (the oracle for the Ray runs), failures in it, and goodput at
scale. Every simulation drives the real `algorithm/` state machine, never a copy of it."""
