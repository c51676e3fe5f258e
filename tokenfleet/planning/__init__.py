"""Capacity planning: the calculator (``tokenfleet plan``); the fleet simulator comes next."""
