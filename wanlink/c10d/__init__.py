"""wanlink.c10d"""
