"""The query side: embed a query, find the nearest frames, merge them into moments with media links."""
