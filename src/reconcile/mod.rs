//! Reconciling Ats: the pure state machine (`decide`) and the API calls that carry it out.

pub mod decide;
