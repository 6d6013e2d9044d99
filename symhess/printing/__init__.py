"""Printers: one per target, dispatching on node type; unknown nodes raise."""
