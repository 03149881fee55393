"""The application wing: what turns the library into the ``python -m lit_amp_det`` command.

``tasks`` (fit/validate/test/predict from a Hydra config), ``config`` (the config tree, its resolvers and
checks), ``runs`` (run folders, ``run.json``, ``ckpt_path=last``), ``sweep`` (the multirun summary) and
``launch`` (DDP child processes under Hydra). Library modules (models, ops, precision, data, callbacks, the
LightningModule) never import from here; errors raised by the library name constructor arguments, and this
layer adds the config path.
"""
