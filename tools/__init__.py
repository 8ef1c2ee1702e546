"""The tools layer: what runs, drives and emulates a cluster, above the services.

``cluster`` (launcher, ``serve`` process shell, chaos, in-process cluster), ``replay`` (workload
replay against a live cluster), ``engine_sim`` (the cost-model engine emulator), ``cli`` (the
``dualpath`` command). Nothing below this package imports it (import-linter contract).
"""
