"""decay-tuner: Optuna search over the scalar-decay kernel's design space."""
