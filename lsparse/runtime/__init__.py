"""Decoding: the dense baseline now; decoding from a flash image under a RAM budget is to come."""
