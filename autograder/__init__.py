"""Instructor tooling: release, collect, sandboxed autograde, feedback and export."""
