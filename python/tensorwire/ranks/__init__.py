"""Ranks: processes that work together, above the device API.

* ``world``: a World, one Device per rank, meeting in one store; its collectives (on the C++
  collectives layer, ``_core.Collectives``, which the torch backend runs on too).
* ``rendezvous``: the stores ranks meet in (their own, torchrun's TCPStore, a c10d store).
* ``roles``: the one launcher of local processes (each with a role, a dead one named, the others stopped).
* ``launch``: ``tensorwire run``, N ranks of a command on this machine or in testbed hosts.

Nothing here is imported by the device API (tensorwire, tensorwire.slots, tensorwire.notify):
the layers are in docs/architecture.md and tests/python/project/test_layers.py.
"""
