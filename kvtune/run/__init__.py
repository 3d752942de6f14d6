"""What every profiling method shares, written once.

- :mod:`kvtune.run.folder`: run folders (safe name, lock, stale temporary files);
- :mod:`kvtune.run.settings`: the settings base (frozen, versioned, JSON, ``--set``);
- :mod:`kvtune.run.method`: what a method supplies (:class:`~kvtune.run.method.Method`) and the
  method registry;
- :mod:`kvtune.run.loop`: the ask/tell loop;
- :mod:`kvtune.run.executors`: where trials are evaluated (in this process, or on Ray actors);
- :mod:`kvtune.run.runner`: run / resume / finalize a run folder for any method.
"""
