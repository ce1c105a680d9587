"""frameworks"""
