"""What every loop stands on: the controller kernel (a keyed queue and the loop draining it),
the operator's settings, its metrics and readiness, the Events it posts, and the crash points the
tests use. Nothing here knows an Engine's plan or a Mind's grant. Below: `client`.
Above: the rest."""
