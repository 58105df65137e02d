"""Work that fans out: a stage's independent units of work run as tasks on a Ray cluster.

``settings`` is what a pipeline writes under ``run.executor``; ``wire`` turns a model and its
calibration tensors into JSON and safetensors bytes (what goes into Ray's object store: no pickled
model); ``ray_pool`` connects, shares, submits with bounded retries and reports where each task ran.
Ray is an optional extra (``pip install 'opus[ray]'``); nothing here imports it until it is asked for.
"""
