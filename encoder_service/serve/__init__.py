"""The encoder pool's Ray Serve replica classes and their metrics: Ray Serve lives here."""
