"""Processes: how a worker comes to be and what it runs.

Owns: what each worker runs (``entrypoint``), the spawners (``spawn``) and the zygote they fork
from (``zygote``, ``preload``), the worker's own side (``worker_main``, ``proctitle``), where
its output goes (``logs``), and the guardian that cleans up after a SIGKILLed launcher.
May import: the foundation only (``api``, ``cancel``, ``compat``, ``errors``). Every worker
imports this package before its script: keep this file free of imports.
"""
