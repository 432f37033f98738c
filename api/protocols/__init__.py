"""The three HTTP protocols, one module each, behind one table (``base.Protocol``)."""
