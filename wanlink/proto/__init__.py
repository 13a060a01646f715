"""wanlink.proto"""
