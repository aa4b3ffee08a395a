"""Errors named by their cause: one family to catch, and the two mistakes ``build_by_name`` names for a user."""

from __future__ import annotations

import inspect

import pytest

import lightning_parcae.errors as errors
from lightning_parcae.errors import ConfigurationError, ParcaeError, build_by_name


def test_every_error_the_package_raises_on_purpose_is_a_parcae_error() -> None:
    classes = [obj for name, obj in vars(errors).items() if inspect.isclass(obj) and issubclass(obj, Exception)
               and obj.__module__ == errors.__name__]
    assert classes and all(issubclass(c, ParcaeError) for c in classes)
    assert all(c.__doc__ for c in classes), "every error class says which cause it names"
    assert set(errors.__all__) >= {c.__name__ for c in classes}


def test_a_configuration_error_is_also_a_value_error() -> None:
    """Callers that catch ValueError around an option keep working."""
    assert issubclass(ConfigurationError, ValueError) and issubclass(errors.CheckpointStorageError, ValueError)


def test_build_by_name_names_an_unknown_name_and_refused_keywords() -> None:
    registry = {"persistence": lambda window=8: ("persistence", window)}
    assert build_by_name(registry, "persistence", {"window": 3}, unknown="?", bad="?") == ("persistence", 3)
    with pytest.raises(ConfigurationError, match="predictor 'arima2' is not one of persistence"):
        build_by_name(registry, "arima2", {}, unknown="predictor 'arima2' is not one of persistence", bad="x")
    with pytest.raises(ConfigurationError, match="predictor persistence: .*unexpected keyword argument 'windw'"):
        build_by_name(registry, "persistence", {"windw": 3}, unknown="?", bad="predictor persistence")
