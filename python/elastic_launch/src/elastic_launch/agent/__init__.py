"""The agent: one per node. It decides what happens to the node's workers and carries it out.

Owns: the agent's loop and states (``agent``), the pure decision (``decide``), the worker group
(``workers``), hang and GPU findings (``hang``, ``activity``, ``devices``), and what the agent
reports (``events``, ``health``, ``summary``).
May import: ``processes``, ``rendezvous`` and the foundation (``api``, ``cancel``, ``compat``,
``errors``, ``net``); never the launcher, never torch.
"""
