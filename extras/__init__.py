"""Parts a run uses only when asked for. Each module extends the core without editing it: it
imports the core, and the composition root (run.py, components.py) imports it when a flag names
one of its parts; no core module imports it or names it, and a default run imports none."""
