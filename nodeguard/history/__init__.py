"""The decision history: what nodeguard did to which workload, when and why, kept on disk across restarts.

Each lever change the executor made and each eviction asked is one JSON line
(``entries``) with the readings, gaps, objective, ranking and candidate rule
of its tick; the lines go to a few rotated files bounded in size
(``segments``), written by a thread of their own after the tick
(``recorder``); ``query`` answers "what did nodeguard do to this pod, and
why" from them, holds on the pod's QoS tier and parent groups included.
"""
