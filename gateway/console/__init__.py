"""The operator console: server-rendered pages under ``/admin/console`` whose script reads and acts through ``/admin``."""
