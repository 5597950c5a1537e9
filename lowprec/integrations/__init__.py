"""Where lowprec plugs into other training frameworks. Each submodule imports its framework, so none is
imported here; install them with ``pip install lowprec[integrations]``.

* :mod:`lowprec.integrations.lightning`: ``LowprecPrecision``, a precision plugin for Lightning's Trainer,
  and ``LowprecFabricPrecision`` for Fabric: convert the model, step through lowprec's step guard.
* :mod:`lowprec.integrations.hf`: ``TelemetryCallback``, lowprec's telemetry from the Hugging Face Trainer
  (convert the model before building the Trainer or calling ``accelerator.prepare``).
* :mod:`lowprec.integrations.torchtitan`: ``LowprecConverter``, a torchtitan model converter.

See docs/integrations.md.
"""
