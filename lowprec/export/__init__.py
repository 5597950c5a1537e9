"""Export: a trained model written in the layouts serving engines load (``hf``, ``fp8``, and the formats
:func:`formats` lists), from a model in memory (:func:`export`) or a run's checkpoint (:func:`load_trained`,
``lowprec export``).

The package is callable: ``lowprec.export(model, out_dir, format="fp8")`` is :func:`export`. A function of
that name in ``lowprec`` would hide this package behind it (``import lowprec.export as e`` would give the
function), so the package itself takes the call.
"""
import sys
import types

from lowprec.export.layout import AS_TRAINED, FROM_MASTER, LayerWeight, Layout
from lowprec.export.registry import formats, get_layout
from lowprec.export.report import KEPT, ExportReport, LayerExport
from lowprec.export.source import TrainedModel, load_trained
from lowprec.export.write import export


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs) -> ExportReport:
        return export(*args, **kwargs)

    __call__.__doc__ = export.__doc__


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["AS_TRAINED", "FROM_MASTER", "KEPT", "ExportReport", "LayerExport", "LayerWeight", "Layout",
           "TrainedModel", "export", "formats", "get_layout", "load_trained"]
