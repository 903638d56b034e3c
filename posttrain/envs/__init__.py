"""Multi-turn environments: the contract, episode assembly, built-ins.

Importing this package registers the built-ins in :data:`ENVIRONMENTS`.
"""
