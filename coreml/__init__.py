"""Core ML packages: conversion, compression recipes, and a numpy MIL reference executor."""
