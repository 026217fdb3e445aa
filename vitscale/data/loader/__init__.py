"""The training loader: :mod:`~vitscale.data.loader.stream` turns this rank's samples into uint8
batches; :mod:`~vitscale.data.loader.reader` fetches and splits sample records,
:mod:`~vitscale.data.loader.decode` decodes images and :mod:`~vitscale.data.loader.transforms`
decides crops and normalises on the device.
"""
