"""Parts a run uses only when asked for; the core reaches them by import path, never by an import statement."""
