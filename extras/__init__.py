"""Parts a run uses only when asked for, one file per component. The core modules reach them through their
registries (import paths such as `extras.wandb_log.WandbLog`), never by an import statement."""
