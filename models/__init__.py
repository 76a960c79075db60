"""The model zoo (re-exported from :mod:`tf_remat.zoo`, which ships with the package).

``get_model(name, batch_size, input_size, num_classes) -> (model, input_spec, label_spec)``.
"""

from tf_remat.zoo import MODELS, get_model, model_specs, parse_input_size  # noqa: F401

__all__ = ["MODELS", "get_model", "model_specs", "parse_input_size"]
