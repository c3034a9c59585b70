"""A run seen as a timeline (`python -m tools.trace RUN_DIR`), one sample's lineage (`... sample RUN_DIR ID`) and
what each actor waits on (`... why RUN_DIR`), from what the run writes: records.py reads it, timeline.py builds
the Chrome/Perfetto trace, lineage.py follows a sample, simulated.py writes the planner's simulation in the
same format."""
