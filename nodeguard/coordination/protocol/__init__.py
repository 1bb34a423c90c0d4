"""The parts of the protocol node (:class:`~nodeguard.coordination.semaphore.ProtocolNode`), one per concern.

From the bottom: model (records of configuration, effects and phases), core (the state), membership, bank,
admission, estates, recovery, outbox, messages; semaphore.py puts the node's public entry points on top.
Each part is a layer on the ones below, and calls only into them.
"""
