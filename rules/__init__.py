"""Packaged rule files (installed as ``ktinject.rulefiles``); see ktinject/rules.py."""
