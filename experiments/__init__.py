"""One runner per artefact; ``run.py`` calls ``experiments.<cfg.experiment.runner>.run(cfg)``."""
