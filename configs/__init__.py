"""Experiment configs, one file each: `get_config(arg) -> ConfigDict`. Installed as `jaxtrain.configs`."""
