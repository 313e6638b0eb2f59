"""moec: compile Mixture-of-Experts language models into fast decode engines on Apache TVM.

``moec.compile(model, out_dir, target=...)`` builds an artifact (``moec.calibrate(model, data, calib_dir)``
fits cascade gating on data for ``compile(..., calibration=calib_dir)``); ``moec.load(out_dir, device=...)``
returns an engine with ``prefill``, ``decode`` and ``generate`` that needs only TVM's runtime.
"""

__version__ = "0.1.0"


def compile(*args, **kwargs):  # noqa: A001
    from .compiler.build import compile as _compile

    return _compile(*args, **kwargs)


def calibrate(*args, **kwargs):
    from .compiler.calibrate import calibrate as _calibrate

    return _calibrate(*args, **kwargs)


def tune(*args, **kwargs):
    from .schedules.tune import tune as _tune

    return _tune(*args, **kwargs)


def load(*args, **kwargs):
    from .runtime.engine import load as _load

    return _load(*args, **kwargs)


__all__ = ["calibrate", "compile", "load", "tune", "__version__"]
