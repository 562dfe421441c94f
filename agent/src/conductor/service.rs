//! The `Balance` service (served on the Peer port): the receiver's side of
//! the conductors' two-phase commit.

use std::sync::Arc;

use ferry_proto::v1::balance_server::Balance;
use ferry_proto::v1::{
    FinishRequest, FinishResponse, OfferRequest, OfferResponse, PullRequest, PullResponse,
};
use tonic::{Request, Response, Status};

use super::Conductor;
use crate::cordon::Cordon;

#[derive(Debug, Clone)]
pub struct BalanceService {
    cordon: Arc<Cordon>,
    /// None without membership: every offer is refused as "disabled".
    conductor: Option<Arc<Conductor>>,
}

impl BalanceService {
    pub fn new(cordon: Arc<Cordon>, conductor: Option<Arc<Conductor>>) -> Self {
        Self { cordon, conductor }
    }
}

#[tonic::async_trait]
impl Balance for BalanceService {
    async fn offer(
        &self,
        request: Request<OfferRequest>,
    ) -> Result<Response<OfferResponse>, Status> {
        let req = request.into_inner();
        if self.cordon.is_on() {
            return Ok(Response::new(OfferResponse {
                accepted: false,
                refusal: "cordoned".into(),
            }));
        }
        let Some(c) = &self.conductor else {
            return Ok(Response::new(OfferResponse {
                accepted: false,
                refusal: "disabled".into(),
            }));
        };
        Ok(Response::new(c.on_offer(&req)))
    }

    async fn finish(
        &self,
        request: Request<FinishRequest>,
    ) -> Result<Response<FinishResponse>, Status> {
        if let Some(c) = &self.conductor {
            c.on_finish(&request.into_inner());
        }
        Ok(Response::new(FinishResponse {}))
    }

    async fn pull(&self, request: Request<PullRequest>) -> Result<Response<PullResponse>, Status> {
        let refuse = |why: &str| {
            Ok(Response::new(PullResponse {
                refusal: why.into(),
                ..Default::default()
            }))
        };
        // A cordoned node gives work away gladly: only a node without a
        // conductor cannot.
        let Some(c) = &self.conductor else {
            return refuse("disabled");
        };
        Ok(Response::new(c.on_pull(&request.into_inner())))
    }
}
